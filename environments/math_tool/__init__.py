"""ReTool-style math environment: Python interpreter tool in the sandbox, ``\\boxed{}`` answers."""

from .data import MATH_DATASETS, load_math
from .env import MathToolConfig, MathToolEnv
from .reward import MathReward, MathRewardConfig, extract_boxed
from .tool import PythonTool, extract_code, print_last_expression

__all__ = ["MATH_DATASETS", "MathReward", "MathRewardConfig", "MathToolConfig", "MathToolEnv",
           "PythonTool", "extract_boxed", "extract_code", "load_math",
           "print_last_expression"]
