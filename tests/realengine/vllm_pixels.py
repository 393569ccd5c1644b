"""Run by the VL venv's Python (``E2E_VLLM_PYTHON``, which has vLLM, torch and torchvision),
not collected by pytest: stdin ``{"kwargs_data": [...], "images": [[base64 bytes, processor]]}``;
stdout an npz of ``engine_<i>`` (the pixel input vLLM built for image i: its
``/v1/chat/completions/render`` tensors, ``pixel_values`` as resized pixels 0-255, normalised
here with the processor's mean and std as vLLM normalises them on the device) and ``rebuilt_<i>``
(``families.vision.rebuild_pixel_values`` of the stored bytes with the torchvision backend)."""

from __future__ import annotations

import base64
import io
import json
import sys

import numpy as np
from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item

from capture_proxy.families.vision import rebuild_pixel_values


def main() -> None:
    request = json.load(sys.stdin)
    out: dict[str, np.ndarray] = {}
    for i, (encoded, (data, processor)) in enumerate(
        zip(request["kwargs_data"], request["images"], strict=True)
    ):
        item = decode_mm_kwargs_item(encoded)
        raw = item["pixel_values"].data.float().numpy()
        mean = np.repeat(np.asarray(processor["image_mean"], np.float32), raw.shape[1] // 3)
        std = np.repeat(np.asarray(processor["image_std"], np.float32), raw.shape[1] // 3)
        out[f"engine_{i}"] = (raw * np.float32(processor["rescale_factor"]) - mean) / std
        out[f"grid_{i}"] = item["image_grid_thw"].data.numpy()
        out[f"rebuilt_{i}"] = rebuild_pixel_values(base64.b64decode(data), processor)
    buf = io.BytesIO()
    np.savez(buf, **out)
    sys.stdout.buffer.write(buf.getvalue())


if __name__ == "__main__":
    main()
