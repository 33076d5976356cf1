"""Compatibility names: the walking skeleton's verifiers now live in `answers`, `boxes` and `format`."""

from vlrl.rewards.answers import multiple_choice, number, ocr  # noqa: F401
from vlrl.rewards.boxes import bbox_iou, box_iou, parse_box  # noqa: F401
from vlrl.rewards.format import answer_format, think_answer_format  # noqa: F401
