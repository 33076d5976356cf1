"""An image as a PNG data URL: the form the HTTP engine sends prompt images in, and a server teacher's scoring requests
(`vlrl.rollout.teacher_client`) too."""

from __future__ import annotations

import base64
import io

from PIL import Image


def encode_image(image: Image.Image) -> str:
    """A PNG data URL (``data:image/png;base64,…``)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
