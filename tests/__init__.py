# A regular package, not a namespace one: draccus (the training config library) ships a top-level `tests`
# package in its wheel (marin-community/draccus#63), which would otherwise win every `from tests.x import`.
