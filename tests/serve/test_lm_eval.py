"""lm-evaluation-harness (``lm-eval``) against ``ppsplit serve``: ``bench/lm_eval_serve.py`` runs a log-likelihood
task and a generate-until task through lm-eval's ``local-completions`` model (a live server on 127.0.0.1) and through
its Hugging Face model on the same checkpoint (the demo model saved as a Hugging Face folder, then compiled)."""
import json
import os
import subprocess
import sys

import pytest

import ppsplit

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_lm_eval_scores_through_the_server_equal_its_hugging_face_model(tmp_path):
    from ppsplit.compile.demo import demo_model, write_demo_tokenizer

    hf = str(tmp_path / "hf")
    demo_model().save_pretrained(hf)
    write_demo_tokenizer(hf)
    folder = ppsplit.compile_model(hf, str(tmp_path / "demo-pp1"), pp=1,
                                   cache=ppsplit.CacheConfig(batch_size=4, max_len=512))
    figures = str(tmp_path / "figures.json")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "lm_eval_serve.py"), folder, "--hf", hf,
                           "--json", figures, "--timeout", "600"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(figures) as f:
        result = json.load(f)
    assert result["server_exit"] == 0
    mc, gen = result["tasks"]["ppsplit_mc"], result["tasks"]["ppsplit_gen"]
    assert mc["rows"] == gen["rows"] == 16
    for task in (mc, gen):
        assert task["scores"] and all(a == b for a, b in task["scores"].values()), task["scores"]
    # 16 questions x 4 choices: the server's prompt logprobs summed as lm-eval sums them, against HF's forward pass
    assert mc["max_abs_loglikelihood_diff"] < 1e-3
    assert mc["greedy_flags_equal"] == "64/64"
    assert gen["generations_equal"] == "16/16"
    assert any(served for served, _ in gen["generations"]), "every generation was empty: nothing was compared"
