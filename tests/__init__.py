"""medusa's tests. A regular package: a dependency's top-level `tests` package (draccus ships one) must not shadow it."""
