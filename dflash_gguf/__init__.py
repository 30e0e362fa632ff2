"""DFlash block-diffusion speculative decoding for llama.cpp GGUF models."""

from .checks import SettingError
from .config import GenerationConfig, SessionOptions
from .drafter import Drafter, PairingError
from .sampling import SamplingParams
from .session import Result, Session, SessionBusyError, SessionClosedError
from .stats import GenerationStats
from .steps import Step, StepKind, TokenSource
from .target import Target

__all__ = [
    "Drafter", "GenerationConfig", "GenerationStats", "PairingError", "Result", "SamplingParams", "Session",
    "SessionBusyError", "SessionClosedError", "SessionOptions", "SettingError", "Step", "StepKind", "Target",
    "TokenSource",
]
