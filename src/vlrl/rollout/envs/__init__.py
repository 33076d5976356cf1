"""Built-in environments (registered on import): ``shapes_feedback``, ``tool_zoom``, ``judge``."""

from vlrl.rollout.envs import judge, shapes_feedback, tool_zoom  # noqa: F401

__all__ = ["judge", "shapes_feedback", "tool_zoom"]
