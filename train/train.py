"""`accelerate launch train/train.py --config configs/...` from a checkout: runs medusa.train.train (the same as
`medusa train`, `python -m medusa.train` and `accelerate launch -m medusa.train`; its docstring has the options)."""

from medusa.train.train import main

if __name__ == "__main__":
    main()
