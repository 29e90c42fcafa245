"""Training heads and drafts (needs the `train` extra: accelerate, datasets, peft): self-distilled data
(`generate_data`), then training (`train`) on it, from a checkout or an installed wheel alike:

    medusa generate-data --config my.yaml     # or python -m medusa.train.generate_data, python train/generate_data.py
    medusa train --config my.yaml             # or accelerate launch -m medusa.train, accelerate launch train/train.py

Nothing here is imported by `import medusa`.
"""
