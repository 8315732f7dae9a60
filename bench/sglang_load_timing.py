"""The bench's clock on SGLang's default loader: built model -> weights in place, as one log line.

SGLang logs "Load weight end. elapsed" for the model's construction and its weights together; the
cache loader logs its own parts (model built, preparation waited on, attach, post-processing). To set
the same span side by side, bench/sglang_gpu.sh installs this module as a plugin of SGLang's
`sglang.srt.plugins` group on the GPU machine only: in every SGLang process it times the default
loader's `load_weights_and_postprocess` (the checkpoint read into the built model, then SGLang's
post-processing) and logs it. Nothing of SGLang's behaviour changes.
"""

import sys
import time

LINE = "bench timing: default loader's weights in place in {:.3f}s"


def register() -> None:
    import torch
    from sglang.srt.model_loader.loader import DefaultModelLoader

    inner = DefaultModelLoader.load_weights_and_postprocess  # a staticmethod: the plain function here

    def timed(model, weights, target_device):
        started = time.perf_counter()
        result = inner(model, weights, target_device)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        print(LINE.format(time.perf_counter() - started), file=sys.stderr, flush=True)
        return result

    DefaultModelLoader.load_weights_and_postprocess = staticmethod(timed)
