"""What only torch can tell about the hardware group: bf16 on a device without it (hardware=bf16, bf16_true) is
refused in one line naming `hardware`, before anything is built (klbench.tasks.train.check_config calls it)."""
from __future__ import annotations

from klbench.config.errors import ConfigError


def cpu_bf16_supported() -> bool:
    """Whether torch's CPU kernels have bfloat16 here: oneDNN's own test (AVX-512 or AMX on x86, BF16 on Arm),
    the one PyTorch's bf16 CPU tests skip on. Without it every bf16 product runs emulated, slower than float32."""
    import torch
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_bf16_runs() -> bool:
    """Whether a bfloat16 matrix product runs on this CPU at all (natively or emulated through float32)."""
    import torch
    try:
        x = torch.ones(2, 2, dtype=torch.bfloat16)
        return bool((x @ x).eq(2).all())
    except RuntimeError:
        return False


def check_bf16(hw) -> None:
    """hardware.precision bf16-* on a GPU without bfloat16, or a CPU where it does not run: one line naming the key
    and what to use. A CPU without native bfloat16 (no AVX-512 BF16 or AMX) runs it emulated: the same bf16
    numbers, slower than float32; that is said in one line, not refused (an AVX2 laptop can check bf16's numerics)."""
    if not str(hw.precision).startswith("bf16"):
        return
    import torch
    on_gpu = hw.accelerator in ("gpu", "cuda") or (hw.accelerator == "auto" and torch.cuda.is_available())
    if on_gpu and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"hardware.precision={hw.precision} (hardware=bf16 or bf16_true) but this GPU "
                          f"({torch.cuda.get_device_name()}) does not support bfloat16: use hardware=gpu")
    if hw.accelerator in ("cpu", "auto") and not on_gpu:
        kernels = f"{torch.backends.cpu.get_cpu_capability()} kernels"
        if not cpu_bf16_runs():
            raise ConfigError(f"hardware.precision={hw.precision} (hardware=bf16 or bf16_true) but bfloat16 "
                              f"products do not run on this CPU ({kernels}): use hardware=cpu")
        if not cpu_bf16_supported():
            print(f"klbench: hardware.precision={hw.precision} on a CPU without native bfloat16 ({kernels}; torch's "
                  "oneDNN has it with AVX-512 BF16 or AMX, BF16 on Arm): bf16 runs emulated, the same numbers, "
                  "slower than float32 (hardware=cpu)")
