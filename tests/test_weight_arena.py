"""engine.weight_arena: a CPU model's linear weights moved into one block of memory, in the order
the forward reads them, without changing a value or what the layers compute."""

import torch

from engine import linear, weight_arena
from engine.kernels import cpu_kernels


def test_pack_moves_every_tensor_in_order_keeping_values_shapes_and_dtypes():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(33, 17, generator=g).bfloat16(), torch.randint(0, 255, (5, 64, 64), generator=g,
                                                                         dtype=torch.uint8),
               torch.randn(7, generator=g), torch.randn(2, 3, 2, 16, generator=g).bfloat16()]
    copies = [t.clone() for t in tensors]
    ids = [id(t) for t in tensors]
    read = lambda: [t.float().sum().item() for t in tensors]  # noqa: E731  (a closure, as a layer's)
    before = read()
    arena = weight_arena.pack(tensors)
    assert arena is not None and [id(t) for t in tensors] == ids          # the same tensor objects
    for t, c in zip(tensors, copies):
        assert t.dtype == c.dtype and t.shape == c.shape and t.is_contiguous() and torch.equal(t, c)
        assert t.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()   # one storage
        assert t.data_ptr() % 64 == 0
    starts = [t.data_ptr() for t in tensors]
    assert starts == sorted(starts)                                       # in list order
    assert (starts[0] - arena.data_ptr()) % 64 == 0
    assert starts[0] % weight_arena.HUGE_PAGE == 0                        # starts on a huge page
    assert read() == before
    assert weight_arena.pack([]) is None


def test_a_quantized_and_a_bf16_layer_compute_the_same_numbers_from_the_arena():
    kernels = cpu_kernels()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=g) * 0.05
    x = torch.randn(3, 64, generator=g).bfloat16()
    for fmt in ("bfloat16", "int8", "int4"):
        keep: list[torch.Tensor] = []
        layer = linear.make_linear(w, None, fmt, torch.bfloat16, kernels=kernels, keep=keep)
        before = layer(x)
        if kernels is not None and kernels.gemv_vectorized():
            assert keep, fmt                  # the kernels' packed weights are what gets moved
        weight_arena.pack(keep)
        assert torch.equal(layer(x), before), fmt


def test_the_engine_reads_its_bf16_linears_from_one_arena(tiny_llama_dir):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="bfloat16",
                                    kv_cache_memory="16MiB"))
    model = engine.runner.model
    kernels = cpu_kernels()
    if kernels is None or not kernels.gemv_vectorized():
        assert model._weights is None          # aten's linears: nothing of the engine's to move
        return
    arena = model._weights
    layer = model.layers[0]
    blocks = layer.qkv.__closure__                          # the layer's packed weight, as it reads it
    held = [c.cell_contents for c in blocks if isinstance(c.cell_contents, torch.Tensor)]
    assert any(t.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr() for t in held)
