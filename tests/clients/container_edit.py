"""Rewrite a .cawsf container with edited META / ROUTING and every checksum made right
again (docs/FORMAT.md §2–§3): what a tool that knows the format could write, so tests
reach the checks that come after the checksums."""
import json
import struct

import xxhash
import zstandard

HEADER_FIXED = 16
TOC_RECORD = 40
PAGE = 4096
META, ROUTING = 1, 4
NAMES = {1: "META", 2: "CODEBOOKS", 3: "SHARD_BANK", 4: "ROUTING", 5: "BLOCK_INDEX"}


def read_sections(data):
    n = struct.unpack_from("<I", data, 12)[0]
    out = {}
    for i in range(n):
        ty, flags, off, size, usize, _ = struct.unpack_from("<IIQQQQ", data, HEADER_FIXED + i * TOC_RECORD)
        raw = data[off:off + size]
        if flags & 1:
            raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=usize)
        elif flags & 2:
            raise ValueError("lz4 sections are not handled here")
        out[ty] = raw
    return out


def reseal(src, dst, edit):
    """Copy container `src` to `dst` after `edit(meta: dict, sections: {type: bytes})`
    (which may change META's JSON and replace sections); sections are stored
    uncompressed, page-aligned, in type order, with TOC, header and META's
    checksum_index recomputed."""
    data = open(src, "rb").read()
    sections = read_sections(data)
    meta = json.loads(sections[META])
    edit(meta, sections)
    types = sorted(sections)
    pad = lambda b: b + b"\0" * (-len(b) % PAGE)
    head_len = HEADER_FIXED + TOC_RECORD * len(types) + 8
    offsets, at = {}, -(-head_len // PAGE) * PAGE
    for ty in types:
        if ty == META:
            continue
        offsets[ty] = at
        at += len(pad(sections[ty]))
    for ty in offsets:
        meta["checksum_index"][NAMES[ty]] = "%016x" % xxhash.xxh3_64_intdigest(sections[ty])
    sections[META] = json.dumps(meta, separators=(",", ":")).encode()
    offsets[META] = at  # META last, as the writer puts it
    toc = b"".join(
        struct.pack("<IIQQQQ", ty, 0, offsets[ty], len(sections[ty]), len(sections[ty]),
                    xxhash.xxh3_64_intdigest(sections[ty]))
        for ty in types)
    head = data[:12] + struct.pack("<I", len(types)) + toc
    head += struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    body = bytearray(pad(head))
    for ty in sorted(types, key=lambda t: offsets[t]):
        assert len(body) == offsets[ty]
        body += pad(sections[ty]) if ty != META else sections[ty]
    open(dst, "wb").write(bytes(body))
