"""An H100 that is not there: inductor compiles for it on a host with no GPU, so a compile that fails on the GPU fails
here first, without device time (bench/gpu_compile.py).

Needs torch's CUDA build (PyPI's, as `bash scripts/test_torch.sh 2.11.0` installs it) and its Triton: the CPU wheel
cannot make even a fake CUDA tensor. The model and optimizer are built under a `FakeTensorMode` on device "cuda"
(shapes, dtypes and strides, no memory), dynamo traces them as on the GPU, and inductor lowers, schedules (its GPU
scheduler: Triton kernels, not the CPU's C++), generates and compiles every Triton kernel to sm_90 code with the
ptxas Triton ships. What needs the device is answered here instead:

- device properties: an H100 SXM's (132 SMs, compute capability 9.0);
- Triton's driver: a target of cuda/90, kernels "loaded" as handles of 0, launches that do nothing;
- inductor's own launcher (it dlopens libcuda) is off, and so is a constant folding that runs kernels while
  compiling (`constant_fold_uniform_value`: a tensor of one value becomes a constant); without it such a tensor
  stays a kernel of its own, so the fake may count a kernel or two the GPU would not make;
- the compiled wrapper's buffers are fake tensors, so a graph "runs": its outputs have the right metadata and the next
  graph (the next layer, the heads) compiles from them as on the GPU. Nothing is computed: a library kernel the
  wrapper calls into a buffer (a cuBLAS GEMM, a scaled GEMM) is not called.

No backward: autograd's engine runs a CUDA tensor's backward on a thread of that device, and starting it asks the CUDA
driver about the device, even for fake tensors; AOT autograd's trace of a training graph runs that engine. So a model
compiles here in inference (no_grad), and an update on gradients made as zeros of the parameters' shapes.

Kernels are compiled in this process (inductor's compile_threads = 1): a compile worker would not have these
patches. What this cannot see: a kernel's numerics, its speed, a launch the GPU refuses (shared memory or
registers beyond the chip's, which ptxas does not check against a launch), and autotuning, whose timings are all equal.
And it fails where the GPU does not on one kind of kernel: Triton parses a kernel by recursive descent, and a foreach
kernel over ~125 tensors (an if-elif per tensor, the per-tensor LAMB update's cast of the gradients) overflows Python's
recursion limit in this process, even on a thread of its own with a raised limit and stack, where the GPU machines'
compile workers, processes that never ran dynamo, compiled it.
"""

from __future__ import annotations

import dataclasses
import types

import torch

SMS, CC = 132, (9, 0)
PROPS = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3 (fake)", major=CC[0], minor=CC[1],
                              multi_processor_count=SMS, total_memory=80 << 30, regs_per_multiprocessor=65536,
                              max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32,
                              L2_cache_size=50 << 20, shared_memory_per_block_optin=232448)


def usable() -> str | None:
    """None when this torch can compile for the fake GPU, else why not."""
    import importlib.util

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build (the CPU wheel cannot make CUDA tensors, even fake)"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


def install() -> torch._subclasses.fake_tensor.FakeTensorMode:
    """Patch torch and Triton as the module doc says; returns the fake mode to build and run the model under."""
    import triton.backends
    from torch._dynamo import device_interface
    from torch._inductor import compile_fx, scheduler, select_algorithm
    from torch._inductor.fx_passes import joint_graph
    from torch._inductor.runtime import benchmarking, hints
    from torch._subclasses.fake_tensor import FakeTensorMode
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import ty_to_cpp
    from triton.runtime import driver as active_driver

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    h100 = hints.DeviceProperties(type="cuda", index=0, multi_processor_count=SMS, cc=CC[0] * 10 + CC[1], major=CC[0],
                                  regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                                  max_threads_per_block=1024, warp_size=32)
    hints.DeviceProperties.create = classmethod(lambda cls, device: h100 if device.type == "cuda"
                                                else h100._replace(type=device.type))
    for name, value in {"get_device_properties": lambda *a, **k: PROPS,
                        "get_device_capability": lambda *a, **k: CC, "current_device": lambda: 0,
                        "device_count": lambda: 1, "set_device": lambda *a, **k: None,
                        "get_device_name": lambda *a, **k: PROPS.name, "synchronize": lambda *a, **k: None}.items():
        setattr(torch.cuda, name, value)
    device_interface.CudaInterface.get_device_properties = staticmethod(lambda *a, **k: PROPS)
    device_interface.CudaInterface.get_compute_capability = staticmethod(lambda *a, **k: CC[0] * 10 + CC[1])
    device_interface.CudaInterface.exchange_device = staticmethod(lambda device: 0)
    device_interface.CudaInterface.current_device = staticmethod(lambda: 0)
    device_interface.CudaInterface.get_raw_stream = staticmethod(lambda index: 0)
    device_interface.CudaInterface.maybe_exchange_device = staticmethod(lambda device: 0)
    torch.cuda._DeviceGuard.__enter__ = lambda self: None
    torch.cuda._DeviceGuard.__exit__ = lambda self, *exc: False
    torch._C._cuda_getCurrentRawStream = lambda index: 0
    # the compiled wrapper allocates its buffers with this (bound when the wrapper module loads): fake ones
    def empty_strided_cuda(size, stride, dtype) -> torch.Tensor:
        with mode:
            return torch.empty_strided(size, stride, dtype=dtype, device="cuda")

    def reinterpret_tensor(tensor: torch.Tensor, size, stride, offset: int = 0) -> torch.Tensor:
        with mode:  # torch's own (C++) would view the fake tensor's meta storage: a meta tensor
            return torch.as_strided(tensor, size, stride, tensor.storage_offset() + offset)

    torch._C._dynamo.guards._empty_strided_cuda = empty_strided_cuda
    torch._C._dynamo.guards._reinterpret_tensor = reinterpret_tensor
    # the wrapper's calls of library kernels (cuBLAS GEMMs, scaled GEMMs) write into a buffer it made: nothing runs,
    # the buffer already has the output's metadata (and some `out=` overloads, _scaled_mm's, have no fake kernel)
    real_kernel = select_algorithm.KernelNamespace.__getattribute__

    def kernel(namespace, name: str):
        fn = real_kernel(namespace, name)
        if name.startswith("__") or not callable(fn):
            return fn

        def call(*args, out=None, **kwargs):
            return out if out is not None else fn(*args, **kwargs)

        return call

    select_algorithm.KernelNamespace.__getattribute__ = kernel
    compile_fx._check_triton_bf16_support = lambda graph: None
    real_to = torch.nn.Module.to

    def to(module: torch.nn.Module, *args, **kwargs) -> torch.nn.Module:
        # a move to where every tensor already is changes nothing on the GPU; on fake tensors torch would swap each
        # parameter, which fails for the tied word embeddings (two modules hold one Parameter)
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        here = [t.device for t in (*module.parameters(), *module.buffers())]
        if dtype is None and device is not None and all(d.type == device.type and d.index == (device.index or 0)
                                                        for d in here):
            return module
        return real_to(module, *args, **kwargs)

    torch.nn.Module.to = to
    scheduler.has_triton = lambda: True
    joint_graph.constant_fold_uniform_value = lambda gm: None
    torch._inductor.config.use_static_cuda_launcher = False
    torch._inductor.config.compile_threads = 1
    benchmarking.benchmarker.benchmark_gpu = lambda *a, **k: 1.0

    class Utils:
        def get_device_properties(self, device: int) -> dict:
            return {"max_shared_mem": PROPS.shared_memory_per_block_optin, "multiprocessor_count": SMS,
                    "max_num_regs": 65536, "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000,
                    "mem_bus_width": 5120}

        def load_binary(self, name, kernel, shared, device) -> tuple:
            return 0, 0, 32, 0, 1024  # module, function, registers, spills, threads: nothing is loaded

    class Launcher:
        def __init__(self, src, metadata) -> None:
            pass

        def __call__(self, *args, **kwargs) -> None:
            pass  # nothing runs: the outputs are fake tensors already

    class Driver:
        utils, launcher_cls = Utils(), Launcher
        is_active = staticmethod(lambda: True)
        get_current_target = staticmethod(lambda: GPUTarget("cuda", CC[0] * 10 + CC[1], 32))
        get_current_device = staticmethod(lambda: 0)
        set_current_device = staticmethod(lambda device: None)
        get_current_stream = staticmethod(lambda index=None: 0)
        get_device_capability = staticmethod(lambda device=None: CC)
        get_active_torch_device = staticmethod(lambda: torch.device("cuda", 0))
        get_device_interface = staticmethod(lambda: torch.cuda)
        map_python_to_cpp_type = staticmethod(ty_to_cpp)
        get_benchmarker = staticmethod(lambda: lambda *a, **k: [1.0, 1.0, 1.0])

    # inductor's kernels look the GPU driver up among Triton's backends, by class
    triton.backends.backends["nvidia"] = dataclasses.replace(triton.backends.backends["nvidia"], driver=Driver)
    active_driver.set_active(Driver())
    active_driver._default = active_driver._active
    return mode
