"""What the fronts' memo tests share: a one-pixel PNG (base64) and the image limits."""

import base64

from capture_proxy.core.images import ImageLimits

LIMITS = ImageLimits(max_bytes=200_000, max_images=4)
#: a 1x1 PNG, base64
PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
    )
).decode()
