"""DFlash block-diffusion speculative decoding for llama.cpp GGUF models."""

from .decoding import Step
from .drafter import Drafter, PairingError
from .sampling import SamplingParams
from .session import GenerationStats, Result, Session
from .target import Target

__all__ = ["Drafter", "GenerationStats", "PairingError", "Result", "SamplingParams", "Session", "Step", "Target"]
