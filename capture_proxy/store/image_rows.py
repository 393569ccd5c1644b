"""The images' rows of both stores: ``images`` (one row per image, content-addressed by the
SHA-256 of its bytes) and ``call_images`` (which calls carry it), written with a call, read by
address, deleted with the last rollout that carries them.

Owns no connection and no transaction: each function runs its statements on the connection it
is given, inside the caller's transaction (as ``sql.py``'s). Its SQL is written with ``?``
placeholders, turned into the dialect's by ``Dialect.sql``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from capture_proxy.core.records import CallRecord


class Dialect(Protocol):
    """What these statements need of ``sql.Dialect`` (not imported: ``sql`` imports this
    module): a shared statement in the database's spelling."""

    def sql(self, template: str) -> str: ...


#: A driver connection (see ``sql.Conn``).
Conn = Any
_ROLLOUT_CALLS = "SELECT call_id FROM calls WHERE rollout_id = ?"


def store_images(d: Dialect, db: Conn, record: CallRecord, *, count: bool = True) -> int:
    """Keep the record's images (once per content: ``images``, keyed by the SHA-256 of the
    bytes) and which of them the call carries (``call_images``), in SHA-256 order (one lock
    order across transactions). Returns the image bytes new to the store (0 when not
    ``count``: PostgreSQL's pipelined put reads nothing back, and its foreign key refuses an
    image whose bytes are unknown). With ``count``, raises ValueError when the record names an
    image whose bytes it lacks and the store does not hold."""
    written = 0
    data = record.image_data or {}
    entries = {str(e["sha256"]): e for e in record.images or []}
    for sha in sorted(entries):
        key = bytes.fromhex(sha)
        entry = entries[sha]
        image = data.get(sha)
        if image is not None:
            cur = db.execute(
                d.sql(
                    "INSERT INTO images (sha256, media_type, width, height, data) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
                ),
                (key, entry["media_type"], int(entry["width"]), int(entry["height"]), image),
            )
            if count and cur.rowcount > 0:
                written += len(image)
        elif (
            count
            and not db.execute(d.sql("SELECT 1 FROM images WHERE sha256 = ?"), (key,)).fetchone()
        ):
            raise ValueError(f"call {record.call_id} names image {sha}, whose bytes are unknown")
        db.execute(
            d.sql("INSERT INTO call_images (call_id, sha256) VALUES (?, ?) ON CONFLICT DO NOTHING"),
            (record.call_id, key),
        )
    return written


def get_images(d: Dialect, db: Conn, shas: Iterable[str]) -> dict[str, tuple[str, int, int, bytes]]:
    """sha256 -> (media type, width, height, bytes) of the stored images among ``shas``."""
    out = {}
    for sha in shas:
        row = db.execute(
            d.sql("SELECT media_type, width, height, data FROM images WHERE sha256 = ?"),
            (bytes.fromhex(sha),),
        ).fetchone()
        if row is not None:
            out[sha] = (str(row[0]), int(row[1]), int(row[2]), bytes(row[3]))
    return out


def delete_images(d: Dialect, db: Conn, rollout_id: str) -> None:
    """Forget which of a rollout's calls carry which image, and delete the images no
    remaining call carries (inside the caller's transaction, in SHA-256 order)."""
    images = [
        bytes(r[0])
        for r in db.execute(
            d.sql(f"SELECT DISTINCT sha256 FROM call_images WHERE call_id IN ({_ROLLOUT_CALLS})"),
            (rollout_id,),
        ).fetchall()
    ]
    db.execute(d.sql(f"DELETE FROM call_images WHERE call_id IN ({_ROLLOUT_CALLS})"), (rollout_id,))
    for sha in sorted(images):  # images no remaining call carries
        db.execute(
            d.sql(
                "DELETE FROM images WHERE sha256 = ? AND NOT EXISTS "
                "(SELECT 1 FROM call_images WHERE sha256 = ?)"
            ),
            (sha, sha),
        )
