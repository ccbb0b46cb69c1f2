"""Data keys per (tenant, subject), wrapped by a key-encryption key, and their shredding.

A run's content fields are sealed (``runlog.schemas._sealing``) under the data key of its
data subject: the person or account the caller named (``open_run(subject=...)``), else the
run itself. A ``KeyStore`` makes that key on first use (AES-256, 32 random bytes), wraps it
with the current KEK (AES-256-GCM, associated data = key id + tenant + subject reference)
and stores only the wrapped form; the plaintext key lives in the memory of the processes
that use it. ``shred(tenant, subject)`` destroys every key of the subject: from then on its
sealed fields decode as ``sealing.ERASED`` everywhere, and the log itself is not rewritten.

Two stores:

* ``KafkaKeyStore`` (production, ``RUNLOG_KEY_STORE=kafka``, the default): one record per
  key in the compacted topic ``<prefix>.keys``, replicated like the events topic and written
  with ``acks=all`` and an idempotent producer; a new key is read back from the topic before
  anything is sealed with it, so an event can never reach the log under a key the log's
  own durability does not hold. A shred is a tombstone: compaction removes the key's record
  from the segment files (``runlog._topics.keys_configs``).
* ``FileKeyStore`` (development, ``RUNLOG_KEY_STORE=file``): one file per key under
  ``RUNLOG_KEY_DIR``, fsynced; a shred unlinks it. A local directory needs no service and
  survives a restart, which Redis (whose restart may be empty) would not promise.

KEKs are versioned (``kek_id``): ``rotate()`` re-wraps every live key under the current KEK,
after which older KEKs can be destroyed, and with them any backup of the keys topic taken
before the shred (docs/concepts/encryption.md).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from runlog._settings import Settings
from runlog.errors import ConfigError, KeyUnavailable, NoKeys
from runlog.schemas._sealing import Sealed
from runlog.schemas._vocabulary import EventType

NONCE_LEN = 12


class _Nonces:
    """96-bit GCM nonces from the OS's random source, drawn in blocks (one system call per
    thousand seals rather than per field); a forked child draws its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._buf = b""
        self._at = 0

    def next(self) -> bytes:
        with self._lock:
            if self._pid != os.getpid() or self._at + NONCE_LEN > len(self._buf):
                self._pid, self._buf, self._at = os.getpid(), os.urandom(NONCE_LEN * 1024), 0
            at = self._at
            self._at = at + NONCE_LEN
            return self._buf[at : at + NONCE_LEN]


_nonces = _Nonces()


# ------------------------------------------------------------------------------------- KEKs


@dataclass(frozen=True)
class Keks:
    """The key-encryption keys by id; ``current`` wraps new keys, all of them unwrap."""

    by_id: dict[str, AESGCM]
    current: str

    @classmethod
    def parse(cls, text: str, *, where: str) -> Keks:
        by_id: dict[str, AESGCM] = {}
        last = None
        for raw in text.replace(",", "\n").splitlines():
            item = raw.strip()
            if not item or item.startswith("#"):
                continue
            kek_id, sep, b64 = item.partition(":")
            try:
                key = base64.b64decode(b64.strip(), validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ConfigError(f"{where}: KEK {kek_id!r} is not base64") from exc
            if not sep or not kek_id.strip() or len(key) != 32:
                raise ConfigError(f"{where}: give KEK_ID:BASE64 of 32 bytes, not {item[:12]!r}")
            by_id[kek_id.strip()] = AESGCM(key)
            last = kek_id.strip()
        if last is None:
            raise ConfigError(f"{where}: names no KEK")
        return cls(by_id, last)

    def wrap(self, key: bytes, aad: bytes) -> tuple[str, bytes]:
        nonce = _nonces.next()
        return self.current, nonce + self.by_id[self.current].encrypt(nonce, key, aad)

    def unwrap(self, kek_id: str, wrapped: bytes, aad: bytes) -> bytes:
        kek = self.by_id.get(kek_id)
        if kek is None:
            raise KeyUnavailable(f"data key wrapped by KEK {kek_id!r}, which is not configured")
        try:
            return kek.decrypt(wrapped[:NONCE_LEN], wrapped[NONCE_LEN:], aad)
        except InvalidTag as exc:
            raise KeyUnavailable(f"a data key does not unwrap under KEK {kek_id!r}") from exc


def new_kek() -> str:
    """A fresh KEK's base64 (``runlog keys new-kek``)."""
    return base64.b64encode(os.urandom(32)).decode()


def next_kek_id(settings: Settings) -> str:
    """The id ``runlog keys new-kek`` gives a new KEK when none is named: ``k<N+1>`` after
    the highest ``k<N>`` configured (``k1`` when none is), so appending it to ``RUNLOG_KEK``
    makes it the current KEK without reusing an id."""
    configured = set(load_keks(settings).by_id) if settings.kek or settings.kek_file else set()
    numbers = [int(k[1:]) for k in configured if k[:1] == "k" and k[1:].isdigit()]
    n = max(numbers, default=0) + 1
    while f"k{n}" in configured:
        n += 1
    return f"k{n}"


def load_keks(settings: Settings) -> Keks:
    if settings.kek is not None:
        return Keks.parse(settings.kek.get_secret_value(), where="RUNLOG_KEK")
    if settings.kek_file:
        try:
            text = Path(settings.kek_file).read_text()
        except OSError as exc:
            raise ConfigError(f"RUNLOG_KEK_FILE={settings.kek_file}: {exc}") from exc
        return Keks.parse(text, where=f"RUNLOG_KEK_FILE={settings.kek_file}")
    raise NoKeys("encryption needs a key-encryption key: RUNLOG_KEK or RUNLOG_KEK_FILE")


# ------------------------------------------------------------------------- wrapped keys


def subject_ref(tenant: str, subject: str) -> str:
    """What the store records of a subject: a digest, so the keys topic names no person."""
    return hashlib.sha256(f"{tenant}\x00{subject}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class WrappedKey:
    key_id: str
    tenant: str
    subject_ref: str
    kek_id: str
    wrapped: bytes
    created_at: float

    def aad(self) -> bytes:
        return f"runlog-key\x00{self.key_id}\x00{self.tenant}\x00{self.subject_ref}".encode()

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "key_id": self.key_id,
                "tenant": self.tenant,
                "subject_ref": self.subject_ref,
                "kek_id": self.kek_id,
                "wrapped": base64.b64encode(self.wrapped).decode(),
                "created_at": self.created_at,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> WrappedKey:
        d = json.loads(data)
        return cls(
            d["key_id"],
            d["tenant"],
            d["subject_ref"],
            d["kek_id"],
            base64.b64decode(d["wrapped"]),
            float(d["created_at"]),
        )


class _Sealer:
    """Seals with one data key (what the codec calls on a writer's side)."""

    __slots__ = ("_aead", "key_id")

    def __init__(self, key_id: str, aead: AESGCM) -> None:
        self.key_id = key_id
        self._aead = aead

    def seal(self, plaintext: str, aad: bytes) -> Sealed:
        nonce = _nonces.next()
        return Sealed(self.key_id, nonce, self._aead.encrypt(nonce, plaintext.encode(), aad))


class KeyStore:
    """Data keys per (tenant, subject): made on first use, cached, shredded for good.

    Subclasses keep the wrapped keys (``_put``, ``_tombstone``, ``_load``, ``_fresh``). Every
    method is thread-safe. A ``KeyStore`` is both the codec's ``Opener`` (``open``) and the
    maker of its ``Sealer``s (``sealer``).
    """

    def __init__(self, keks: Keks, *, refresh_s: float = 5.0) -> None:
        self.keks = keks
        self.refresh_s = refresh_s
        self._lock = threading.RLock()
        self._wrapped: dict[str, WrappedKey] = {}
        """Every live key the store holds, as last read."""
        self._aeads: dict[str, AESGCM] = {}
        self._current: dict[tuple[str, str], _Sealer] = {}
        self._gone: set[str] = set()
        """Key ids looked up and not found: destroyed (looked up once, not per event)."""
        self._suspect: dict[str, float] = {}
        """Key ids a CONTENT_ERASED this process read names -> until when (monotonic) each
        open of them re-reads the store's news first (``suspect``)."""
        self._polled = 0.0
        self._loaded = False
        self._refreshed = 0.0
        self.bootstrap_servers: str | None = None
        """The Kafka cluster the store lives on (None: not on Kafka)."""

    # ---------------------------------------------------------------- storage (subclasses)

    def _put(self, wk: WrappedKey) -> None:
        """Store ``wk`` durably; on return, a fresh ``_fresh`` of any process sees it."""
        raise NotImplementedError

    def _tombstone(self, key_id: str) -> None:
        """Destroy the stored key ``key_id`` durably."""
        raise NotImplementedError

    def _fresh(self) -> Iterable[tuple[str, WrappedKey | None]]:
        """What changed since the last call (``None``: destroyed); everything the first time."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the store's clients."""

    # ------------------------------------------------------------------------- the index

    def refresh(self, *, force: bool = False) -> None:
        """Read the store's news: new keys, and shreds made by other processes (their keys
        leave this process's caches at once)."""
        with self._lock:
            now = time.monotonic()
            if not force and self._loaded and now - self._refreshed < self.refresh_s:
                return
            for key_id, wk in self._fresh():
                if wk is None:
                    self._forget(key_id)
                else:
                    self._wrapped[key_id] = wk
                    self._gone.discard(key_id)
            self._loaded, self._refreshed = True, time.monotonic()

    def _forget(self, key_id: str) -> None:
        self._suspect.pop(key_id, None)
        self._wrapped.pop(key_id, None)
        self._aeads.pop(key_id, None)
        self._gone.add(key_id)
        for k, s in list(self._current.items()):
            if s.key_id == key_id:
                del self._current[k]

    def key_ids(self, tenant: str, subject: str) -> list[str]:
        """The live keys of a subject (usually one; two writers that made its first key at
        the same moment leave two, both kept), oldest first."""
        self.refresh(force=True)
        ref = subject_ref(tenant, subject)
        with self._lock:
            found = [
                w for w in self._wrapped.values() if w.tenant == tenant and w.subject_ref == ref
            ]
        return [w.key_id for w in sorted(found, key=lambda w: (w.created_at, w.key_id))]

    def _aead(self, wk: WrappedKey) -> AESGCM:
        aead = self._aeads.get(wk.key_id)
        if aead is None:
            aead = self._aeads[wk.key_id] = AESGCM(
                self.keks.unwrap(wk.kek_id, wk.wrapped, wk.aad())
            )
        return aead

    # ---------------------------------------------------------------------- the codec's

    def sealer(self, tenant: str, subject: str) -> _Sealer:
        """The sealer of ``subject``'s current data key, made (and durable) on first use."""
        with self._lock:
            self.refresh()
            found = self._current.get((tenant, subject))
            if found is not None and found.key_id in self._wrapped:
                return found
            ref = subject_ref(tenant, subject)
            live = [
                w for w in self._wrapped.values() if w.tenant == tenant and w.subject_ref == ref
            ]
            if live:
                wk = max(live, key=lambda w: (w.created_at, w.key_id))
            else:
                key = AESGCM.generate_key(bit_length=256)
                key_id = uuid.uuid4().hex
                draft = WrappedKey(key_id, tenant, ref, self.keks.current, b"", time.time())
                kek_id, wrapped = self.keks.wrap(key, draft.aad())
                wk = WrappedKey(key_id, tenant, ref, kek_id, wrapped, draft.created_at)
                self._put(wk)
                self._wrapped[key_id] = wk
                self._aeads[key_id] = AESGCM(key)
            sealer = self._current[(tenant, subject)] = _Sealer(wk.key_id, self._aead(wk))
            return sealer

    def open(self, key_id: str, nonce: bytes, ciphertext: bytes, aad: bytes) -> str | None:
        """The plaintext of one sealed field; None once its key is destroyed."""
        aead = self._aeads.get(key_id)
        if (
            aead is None
            or key_id in self._suspect
            or time.monotonic() - self._refreshed > self.refresh_s
        ):
            aead = self._lookup(key_id)
            if aead is None:
                return None
        try:
            return aead.decrypt(nonce, ciphertext, aad).decode()
        except InvalidTag as exc:
            raise ValueError(f"sealed value under key {key_id} does not authenticate") from exc

    def _lookup(self, key_id: str) -> AESGCM | None:
        with self._lock:
            self.refresh()
            until = self._suspect.get(key_id)
            if until is not None:
                now = time.monotonic()
                if now > until:
                    del self._suspect[key_id]  # no shred came: a live key after all
                elif now - self._polled >= SUSPECT_POLL_S:
                    self._polled = now
                    self.refresh(force=True)
            if key_id not in self._wrapped and key_id not in self._gone:
                self.refresh(force=True)  # a key made a moment ago by another process
            wk = self._wrapped.get(key_id)
            if wk is None:
                self._gone.add(key_id)
                return None
            return self._aead(wk)

    # ------------------------------------------------------------------ shred and rotate

    def shred(self, tenant: str, subject: str) -> list[str]:
        """Destroy every data key of ``subject``; the key ids destroyed ([] when none is
        left: shredding twice is harmless). Durable on return; other processes learn of it
        within ``RUNLOG_KEYS_REFRESH_MS`` (their next lookup of an unknown key at once)."""
        ids = self.key_ids(tenant, subject)
        with self._lock:
            for key_id in ids:
                self._tombstone(key_id)
                self._forget(key_id)
            self._current.pop((tenant, subject), None)
        return ids

    def drop_cached(self, key_ids: Iterable[str]) -> None:
        """Forget keys another process shredded (a reader that saw the erasure event)."""
        with self._lock:
            for key_id in key_ids:
                self._forget(key_id)

    def suspect(self, key_ids: Iterable[str]) -> None:
        """This process read a CONTENT_ERASED naming ``key_ids`` (a forget records it just
        before it shreds them): the store's news is read now, and every open of one of them
        re-reads it first (at most every ``SUSPECT_POLL_S``) until the shred is seen, so a
        long-lived reader stops opening the subject's content at once, not at its next
        refresh. A key no shred follows (a forget killed before its shred, which its re-run
        completes) is trusted again after ``refresh_s``. Never destroys anything by itself:
        a forged or fenced CONTENT_ERASED cannot make a live key read as gone."""
        with self._lock:
            ids = [k for k in key_ids if k not in self._gone]
            if not ids:
                return
            until = time.monotonic() + max(self.refresh_s, 1.0)
            for key_id in ids:
                self._suspect[key_id] = until
            self._polled = time.monotonic()
            self.refresh(force=True)

    def rotate(self) -> int:
        """Re-wrap every live key under the current KEK; the number re-wrapped. Afterwards
        older KEKs may be destroyed (and with them every copy of a key shredded before)."""
        self.refresh(force=True)
        n = 0
        with self._lock:
            for wk in list(self._wrapped.values()):
                if wk.kek_id == self.keks.current:
                    continue
                key = self.keks.unwrap(wk.kek_id, wk.wrapped, wk.aad())
                kek_id, wrapped = self.keks.wrap(key, wk.aad())
                new = WrappedKey(
                    wk.key_id, wk.tenant, wk.subject_ref, kek_id, wrapped, wk.created_at
                )
                self._put(new)
                self._wrapped[wk.key_id] = new
                n += 1
        return n


class FileKeyStore(KeyStore):
    """Wrapped keys as files ``<dir>/<key id>.json`` (development on one machine)."""

    def __init__(self, directory: str | Path, keks: Keks, *, refresh_s: float = 5.0) -> None:
        super().__init__(keks, refresh_s=refresh_s)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _put(self, wk: WrappedKey) -> None:
        tmp = self.dir / f".{wk.key_id}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(wk.to_json())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.dir / f"{wk.key_id}.json")
        self._sync_dir()

    def _tombstone(self, key_id: str) -> None:
        path = self.dir / f"{key_id}.json"
        if path.exists():
            size = path.stat().st_size
            with open(path, "r+b") as fh:  # overwrite before unlinking: best effort on disk
                fh.write(b"\0" * size)
                fh.flush()
                os.fsync(fh.fileno())
            path.unlink()
        self._sync_dir()

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _fresh(self) -> Iterable[tuple[str, WrappedKey | None]]:
        present = {p.stem: p for p in self.dir.glob("*.json")}
        for key_id in list(self._wrapped):
            if key_id not in present:
                yield key_id, None
        for key_id, path in present.items():
            if key_id not in self._wrapped:
                try:
                    yield key_id, WrappedKey.from_json(path.read_bytes())
                except FileNotFoundError:  # shredded meanwhile
                    continue


class KafkaKeyStore(KeyStore):
    """Wrapped keys in the compacted topic ``<prefix>.keys`` (record key = key id)."""

    def __init__(self, settings: Settings, keks: Keks, *, refresh_s: float = 5.0) -> None:
        super().__init__(keks, refresh_s=refresh_s)
        self.settings = settings
        self.bootstrap_servers = settings.bootstrap_servers
        self.topic = settings.keys_topic
        self._producer: Any = None
        self._consumer: Any = None
        self._position = 0

    def _clients(self) -> tuple[Any, Any]:
        if self._producer is None:
            from confluent_kafka import Consumer, Producer, TopicPartition

            from runlog.log._kafka import reader_config, with_logger

            conf = dict(self.settings.kafka_common())
            conf.update(
                {
                    "enable.idempotence": True,
                    "acks": "all",
                    "delivery.timeout.ms": self.settings.delivery_timeout_ms,
                    "linger.ms": 0,
                }
            )
            self._producer = Producer(with_logger(conf))
            self._consumer = Consumer(reader_config(self.settings))
            self._consumer.assign([TopicPartition(self.topic, 0, 0)])
        return self._producer, self._consumer

    def _send(self, key: bytes, value: bytes | None) -> int:
        producer, _ = self._clients()
        result: dict[str, Any] = {}

        def done(err: Any, msg: Any) -> None:
            result["err"], result["offset"] = err, None if err else msg.offset()

        producer.produce(self.topic, key=key, value=value, on_delivery=done)
        left = producer.flush(self.settings.delivery_timeout_ms / 1000 + 5)
        if left or result.get("err") is not None or "offset" not in result:
            raise KeyUnavailable(
                f"key store {self.topic}: write not acknowledged: {result.get('err') or 'timeout'}"
            )
        offset: int = result["offset"]
        return offset

    def _put(self, wk: WrappedKey) -> None:
        offset = self._send(wk.key_id.encode(), wk.to_json())
        # Read-your-write: nothing is sealed under the key before the topic serves it back.
        deadline = time.monotonic() + self.settings.delivery_timeout_ms / 1000
        while self._position <= offset:
            self._read_to(offset + 1, deadline)
        if self._wrapped.get(wk.key_id) != wk:
            raise KeyUnavailable(f"key store {self.topic}: key {wk.key_id} did not read back")

    def _tombstone(self, key_id: str) -> None:
        self._send(key_id.encode(), None)

    def _end(self) -> int:
        _, consumer = self._clients()
        from confluent_kafka import KafkaException

        from runlog.log._kafka import retrying

        try:
            _, high = retrying(
                f"key store {self.topic}",
                lambda: consumer.get_watermark_offsets(self._tp(), timeout=10.0, cached=False),
            )
        except KafkaException as exc:  # pragma: no cover - retrying wraps the transient ones
            raise KeyUnavailable(f"key store {self.topic}: {exc}") from exc
        end: int = high
        return end

    def _tp(self) -> Any:
        from confluent_kafka import TopicPartition

        return TopicPartition(self.topic, 0)

    def _read_to(self, end: int, deadline: float) -> list[tuple[str, WrappedKey | None]]:
        """Records up to offset ``end`` (exclusive), applied to the index as they come."""
        from confluent_kafka import KafkaError

        _, consumer = self._clients()
        got: list[tuple[str, WrappedKey | None]] = []
        while self._position < end:
            if time.monotonic() > deadline:
                raise KeyUnavailable(f"key store {self.topic}: not read to offset {end} in time")
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    # The end: compaction may have removed the records just below it.
                    self._position = max(self._position, msg.offset())
                    continue
                raise KeyUnavailable(f"key store {self.topic}: {msg.error()}")
            self._position = msg.offset() + 1
            key_id = (msg.key() or b"").decode()
            value = msg.value()
            item = (key_id, None if value is None else WrappedKey.from_json(value))
            got.append(item)
            if item[1] is None:
                self._forget(key_id)
            else:
                self._wrapped[key_id] = item[1]
                self._gone.discard(key_id)
        return got

    def _fresh(self) -> Iterable[tuple[str, WrappedKey | None]]:
        end = self._end()
        return self._read_to(end, time.monotonic() + 30)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._producer is not None:
            self._producer.flush(5)
            self._producer = None


# -------------------------------------------------------------------- composition root

SUSPECT_POLL_S = 0.05
"""How often an open of a suspect key re-reads the store's news (``KeyStore.suspect``)."""


def learn(keys: object, event: Any) -> None:
    """What a reader does with each event it decoded: a CONTENT_ERASED makes the process's
    key store suspect the keys it names (``KeyStore.suspect``): caches in running processes
    learn of an erasure through the log."""
    if event.type is EventType.CONTENT_ERASED and isinstance(keys, KeyStore):
        keys.suspect(event.payload.key_ids)


_shared: dict[tuple[str, int], KeyStore] = {}
_shared_lock = threading.Lock()


def key_store(settings: Settings) -> KeyStore:
    """A new key store for ``settings`` (``RUNLOG_KEY_STORE``, ``RUNLOG_KEK``...)."""
    keks = load_keks(settings)
    refresh_s = settings.keys_refresh_ms / 1000
    if settings.key_store == "file":
        if not settings.key_dir:
            raise ConfigError("RUNLOG_KEY_STORE=file needs RUNLOG_KEY_DIR")
        return FileKeyStore(settings.key_dir, keks, refresh_s=refresh_s)
    return KafkaKeyStore(settings, keks, refresh_s=refresh_s)


def keys_for(settings: Settings) -> KeyStore | None:
    """The process's key store for ``settings``: what readers open with and writers seal
    with. None when no KEK is configured and encryption is off (sealed records then raise
    ``NoKeys``); ``NoKeys`` when encryption is on without a KEK."""
    if settings.kek is None and not settings.kek_file:
        if settings.encryption == "on":
            raise NoKeys("RUNLOG_ENCRYPTION=on needs RUNLOG_KEK or RUNLOG_KEK_FILE")
        return None
    key = (settings.fingerprint(), os.getpid())
    with _shared_lock:
        store = _shared.get(key)
        if store is None:
            store = _shared[key] = key_store(settings)
        return store


def sealer_for(settings: Settings, tenant: str, subject: str) -> _Sealer | None:
    """The writer's sealer for a run's subject; None when ``RUNLOG_ENCRYPTION`` is off."""
    if settings.encryption != "on":
        return None
    store = keys_for(settings)
    assert store is not None  # keys_for raises when encryption is on without a KEK
    return store.sealer(tenant, subject)


def close_shared(bootstrap_servers: str | None = None) -> None:
    """Close the process's shared key stores: all, or those of ``bootstrap_servers`` (before
    that cluster goes away). The next ``keys_for`` makes a new one, its caches empty."""
    with _shared_lock:
        keys = [
            k
            for k, store in _shared.items()
            if bootstrap_servers is None or store.bootstrap_servers in (None, bootstrap_servers)
        ]
        stores = [_shared.pop(k) for k in keys]
    for store in stores:
        store.close()
