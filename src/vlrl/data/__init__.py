"""Data: the `Sample` record, file readers/writers, and the procedural task suites."""

from vlrl.data.io import DataError, ReadReport, read_samples, write_samples
from vlrl.data.sample import Sample, SampleError, load_image
from vlrl.data.tasks import TASK_SUITES, generate

__all__ = [
    "DataError", "ReadReport", "Sample", "SampleError", "TASK_SUITES", "generate", "load_image", "read_samples",
    "write_samples",
]
