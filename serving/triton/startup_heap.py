"""What a model's start-up left on the heap is kept out of the garbage collector's way.

torch, transformers and a loaded tokenizer leave millions of long-lived objects. Every full
collection walks all of them: a pause on whichever thread allocates at that moment while the
server serves, and seconds of CPU when the stub's interpreter exits and collects repeatedly
(about 2.5 s per stub on two cores, most of a test server's shutdown). `gc.freeze()` moves
everything alive now into a permanent generation that collections skip; what the model
allocates later is collected as usual. vLLM does the same after its engine starts.
"""
import gc


def freeze_startup_heap() -> None:
    """Call last in a model's initialize(): collect start-up's garbage once, then freeze the rest."""
    gc.collect()
    gc.freeze()
