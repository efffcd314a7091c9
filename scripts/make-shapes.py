"""Writes specs/data/shapes/: 256 small PNG images in 4 classes (64 each) for the
image-folder example (specs/resnet-images.yaml) — horizontal stripes, vertical stripes, a
checkerboard and a centred square, each 20 wide and 16 high (RGB) with a random colour,
phase and noise.
Deterministic (seed 0). Python's standard library only (zlib for the PNG data).

    python3 scripts/make-shapes.py
"""

import pathlib
import random
import struct
import zlib

OUT = pathlib.Path(__file__).resolve().parents[1] / "specs/data/shapes"
W, H = 20, 16


def png(path, pixels):
    raw = b"".join(b"\x00" + bytes(v for p in row for v in p) for row in pixels)

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def image(kind, rng):
    fg = [rng.randrange(128, 256) for _ in range(3)]
    bg = [rng.randrange(0, 96) for _ in range(3)]
    phase, period = rng.randrange(4), rng.choice([4, 5, 6])
    rows = []
    for y in range(H):
        row = []
        for x in range(W):
            on = {
                "h-stripes": (y + phase) % period < period // 2,
                "v-stripes": (x + phase) % period < period // 2,
                "checker": ((x + phase) // 3 + (y + phase) // 3) % 2 == 0,
                "square": 6 <= x - phase + 2 < 14 and 4 <= y - phase + 2 < 12,
            }[kind]
            c = fg if on else bg
            row.append(tuple(max(0, min(255, v + rng.randrange(-6, 7))) for v in c))
        rows.append(row)
    return rows


rng = random.Random(0)
for kind in ["checker", "h-stripes", "square", "v-stripes"]:
    folder = OUT / kind
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(64):
        png(folder / f"{i:03d}.png", image(kind, rng))
print(sum(f.stat().st_size for f in OUT.rglob("*.png")), "bytes")
