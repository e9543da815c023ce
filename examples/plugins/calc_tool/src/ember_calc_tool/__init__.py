"""Example Ember plugin: multi-turn rollouts in which the model calls a calculator tool."""

from ember_calc_tool.plugin import SECTION, CalcToolConfig
from ember_calc_tool.task import calc_reward, calculate

__all__ = ["SECTION", "CalcToolConfig", "calc_reward", "calculate"]
