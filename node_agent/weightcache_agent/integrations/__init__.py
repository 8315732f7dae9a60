"""Ready-made attach paths for model libraries engines build on (each an optional extra).

`integrations.transformers.from_cache` builds a Hugging Face transformers model from the
checkpoint's config.json on the meta device and attaches it through `client.attach`
(with `materialize=` and `cast_small=`). Each module here imports its library at its
own import, so the rest of the package, the engine-side client included, never needs it.

May import: the base modules, `load` (checkpoint headers, FP8 naming) and `client`.
Never `serve`, `engine` or `testing`.
"""
