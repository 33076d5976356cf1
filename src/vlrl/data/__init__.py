"""Data: the `Sample` record, file readers/writers, and the procedural task suites."""

from vlrl.data.io import DataError, ReadReport, read_samples, write_samples
from vlrl.data.sample import Sample, SampleError, load_image
from vlrl.data.tasks import TASK_SUITES, generate
from vlrl.data.video import MediaLimits, prepare_media

__all__ = [
    "DataError", "MediaLimits", "ReadReport", "Sample", "SampleError", "TASK_SUITES", "generate", "load_image", "prepare_media", "read_samples",
    "write_samples",
]
