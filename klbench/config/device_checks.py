"""What only torch can tell about the hardware group: bf16 on a device without it (hardware=bf16, bf16_true) is
refused in one line naming `hardware`, before anything is built (klbench.tasks.train.check_config calls it)."""
from __future__ import annotations

from klbench.config.errors import ConfigError


def cpu_bf16_supported() -> bool:
    """Whether torch's CPU kernels have bfloat16 here: oneDNN's own test (AVX-512 or AMX on x86, BF16 on Arm),
    the one PyTorch's bf16 CPU tests skip on. Without it every bf16 product runs emulated, slower than float32."""
    import torch
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def check_bf16(hw) -> None:
    """hardware.precision bf16-* on a GPU or a CPU that lacks bfloat16: one line naming the key and what to use."""
    if not str(hw.precision).startswith("bf16"):
        return
    import torch
    on_gpu = hw.accelerator in ("gpu", "cuda") or (hw.accelerator == "auto" and torch.cuda.is_available())
    if on_gpu and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"hardware.precision={hw.precision} (hardware=bf16 or bf16_true) but this GPU "
                          f"({torch.cuda.get_device_name()}) does not support bfloat16: use hardware=gpu")
    if hw.accelerator in ("cpu", "auto") and not on_gpu and not cpu_bf16_supported():
        raise ConfigError(f"hardware.precision={hw.precision} (hardware=bf16 or bf16_true) but this CPU "
                          f"({torch.backends.cpu.get_cpu_capability()} kernels) lacks bfloat16 in torch's oneDNN "
                          "(AVX-512 or AMX on x86, BF16 on Arm), so every bf16 product would be emulated: use hardware=cpu")
