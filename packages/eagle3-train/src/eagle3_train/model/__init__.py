"""The draft network and its kernels: the shape (arch), the decoder layer and its Llama / MLA
attention (chunked reference beside the flash kernel), the TTT unroll (draft), the loss, the one
shift, activation recompute. No I/O and no distributed code."""
