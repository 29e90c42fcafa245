"""`python -m medusa.train` / `accelerate launch -m medusa.train --config ...`: medusa.train.train."""

from medusa.train.train import main

main()
