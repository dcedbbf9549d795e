"""``python -m ppsplit.run DIR ...``: the body of one rank (under torchrun or ``ppsplit run``); see
``ppsplit.distributed.launch``."""
from ppsplit.distributed.launch import rank_main

if __name__ == "__main__":
    rank_main()
