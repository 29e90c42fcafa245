"""`python train/generate_data.py --config configs/...` from a checkout: runs medusa.train.generate_data (the same as
`medusa generate-data` and `python -m medusa.train.generate_data`; its docstring has the options)."""

from medusa.train.generate_data import main

if __name__ == "__main__":
    main()
