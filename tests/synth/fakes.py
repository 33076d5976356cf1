"""Test back-ends, reachable by dotted path (``tests.synth.fakes:make_slow``) also from worker processes."""

import threading
import time

import numpy as np

GATE = threading.Event()  # thread executor: jobs of `gated` wait until the test opens it


class Gated:
    """Waits for `GATE` (thread executor), then returns an all-black image: the foreground must come back."""

    name = "gated"

    def generate(self, image, keep, description, *, seed):
        GATE.wait(30)
        return np.zeros_like(image), {}


class Sleeper:
    """Sleeps ``seconds`` when the description says "sleep", fails when it says "fail", else inverts the image."""

    name = "sleeper"

    def __init__(self, *, seconds=30.0):
        self.seconds = seconds

    def generate(self, image, keep, description, *, seed):
        if "sleep" in description:
            time.sleep(self.seconds)
        if "fail" in description:
            raise RuntimeError("the back-end broke on purpose")
        return 255 - image, {"inverted": True}


class Resizer:
    """A broken back-end: returns the wrong shape."""

    name = "resizer"

    def generate(self, image, keep, description, *, seed):
        return image[:-1], {}


def make_gated(**options):
    return Gated()


def make_sleeper(**options):
    return Sleeper(**options)


def make_resizer(**options):
    return Resizer()
