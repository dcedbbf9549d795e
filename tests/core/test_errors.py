"""Bad input gets a ppsplit error that names the values and the fix."""
from types import SimpleNamespace

import pytest
import torch

import ppsplit
from ppsplit import ConfigError, CrossingError, LayersNotFoundError, TraceError
from tests.support import NUM_LAYERS, tiny_model


class Block(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.proj = torch.nn.Linear(h, h)

    def forward(self, x):
        return x + torch.tanh(self.proj(x))


class ToyDecoder(torch.nn.Module):
    """A minimal decoder LM; ``skip=True`` adds the embedding output to every layer's output (a long skip)."""

    _no_split_modules = ["Block"]

    def __init__(self, skip=False, branch=False, layers_as_list=True):
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=3, vocab_size=32, max_position_embeddings=64)
        self.skip, self.branch = skip, branch
        self.embed = torch.nn.Embedding(32, 16)
        blocks = [Block(16) for _ in range(3)]
        self.layers = torch.nn.ModuleList(blocks) if layers_as_list else torch.nn.Sequential(*blocks)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, input_ids, position_ids=None, use_cache=None):
        x0 = h = self.embed(input_ids)
        if self.branch and input_ids.sum() > 10:  # data-dependent Python control flow
            h = h * 2
        for layer in self.layers:
            h = layer(h) + (x0 if self.skip else 0)
        return (self.head(h),)


def test_pp_out_of_range_fails_before_tracing():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match=rf"pp must be between 1 and {NUM_LAYERS} \(the model has {NUM_LAYERS} "
                                          rf"decoder layers\), but got 9"):
        ppsplit.split_model(model, 9)
    with pytest.raises(ConfigError, match="pp must be a positive number of stages, but got 0"):
        ppsplit.split_model(model, 0)


def test_tap_out_of_range():
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match=rf"aux id {NUM_LAYERS + 1} is out of range"):
        ppsplit.split_model(model, 2, aux=[1, NUM_LAYERS + 1])
    with pytest.raises(ConfigError, match=r"aux id -2 is out of range: with --aux-convention sglang tap ids go from -1"):
        ppsplit.split_model(model, 2, aux="-2", aux_convention="sglang")
    with pytest.raises(ConfigError, match="aux must be 'eagle3' or comma-separated layer ids"):
        ppsplit.split_model(model, 2, aux="2,x")
    with pytest.raises(ConfigError, match="aux_convention must be"):
        ppsplit.split_model(model, 2, aux="1", aux_convention="eagle")


def test_eagle3_needs_enough_layers():
    with pytest.raises(ConfigError, match="needs at least 4 decoder layers; the model has 3"):
        ppsplit.split_model(ToyDecoder(), 1, aux="eagle3")


def test_layers_not_found():
    with pytest.raises(LayersNotFoundError, match="could not find the decoder layers of ToyDecoder.*pass layers="):
        ppsplit.split_model(ToyDecoder(layers_as_list=False), 2)
    with pytest.raises(LayersNotFoundError, match="layers='model.blocks' names no submodule"):
        ppsplit.split_model(tiny_model("llama"), 2, layers="model.blocks")


def test_export_failure_names_the_line():
    with pytest.raises(TraceError, match=r"torch.export could not capture ToyDecoder: .*test_errors.py:\d+"):
        ppsplit.split_model(ToyDecoder(branch=True), 2)


def test_value_other_than_residual_crossing_is_named():
    model = ToyDecoder(skip=True)
    with pytest.raises(CrossingError, match=r"2 token-dependent values enter decoder layer 1 and ppsplit cannot tell "
                                            r"which is the residual stream \(the model's config names no hidden_size"
                                            r".*%embedding"):
        ppsplit.split_model(model, 2)
    # Without a boundary there is nothing to cross, and the toy model splits (pp=1) and runs.
    split = ppsplit.split_model(model, 1)
    ids = torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(split(ids)[0], model(ids)[0])


def test_ambiguous_tap_is_refused():
    with pytest.raises(CrossingError, match="tap 2 is ambiguous"):
        ppsplit.split_model(ToyDecoder(skip=True), 1, aux=[2])


def test_toy_decoder_without_skip_splits_exactly():
    model = ToyDecoder()
    split = ppsplit.split_model(model, 3, aux=[0, 3])
    ids = torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        logits, aux = split(ids)
        torch.testing.assert_close(logits, model(ids)[0])
        torch.testing.assert_close(aux[0], model.embed(ids))
