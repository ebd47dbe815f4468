#!/usr/bin/env python3
"""Report, and optionally trim, the CUDA fat binaries inside an ELF shared object.

    fatbin_trim.py LIB.so                      # per-arch bytes in .nv_fatbin
    fatbin_trim.py LIB.so --keep 90 --out X.so # keep only sm_90 code

Trimming works container by container inside .nv_fatbin: it keeps the ELF
(SASS) entries of the --keep archs; where a container has none, it keeps its
PTX entries (arch <= max keep) so the driver can JIT them; where nothing would
be left it keeps the container's smallest entry, so no container is empty.
Kept entries are packed to the front, the container's size field is updated,
and the freed tail is zero-filled, so every offset in the file stays valid and
xz squeezes the zeros away. File size is unchanged; compress it to carry it.
Entry header layout (kind u16 @0, header size u32 @4, payload size u64 @8,
arch u32 @28) as read by cuobjdump; verify the result with
`cuobjdump --list-elf X.so`. Used by build_bundle.sh (see tools/gpu_engines/README.md)."""
import argparse
import collections
import re
import struct
import subprocess

MAGIC = 0xBA55ED50

def section(path, name):
    out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = re.match(r"\s*\[\s*\d+\]\s+(\S+)\s+\S+\s+([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+)", line)
        if m and m.group(1) == name:
            return int(m.group(3), 16), int(m.group(4), 16)
    raise SystemExit(f"{path}: no section {name}")

def containers(buf, off, end):
    while off + 16 <= end:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", buf, off)
        if magic != MAGIC:
            off += 8  # alignment padding between containers
            continue
        ents, p, e = [], off + hsz, off + hsz + fsz
        while p < e:
            kind, _u, ehsz, psize = struct.unpack_from("<HHIQ", buf, p)
            arch = struct.unpack_from("<I", buf, p + 28)[0]
            ents.append((p, kind, ehsz, psize, arch))
            p += ehsz + psize
        yield off, hsz, fsz, ents
        off = e

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("so")
    ap.add_argument("--keep", help="comma list, e.g. 90")
    ap.add_argument("--out")
    a = ap.parse_args()
    foff, fsize = section(a.so, ".nv_fatbin")
    with open(a.so, "rb") as f:
        data = bytearray(f.read())
    keep = {int(x) for x in a.keep.split(",")} if a.keep else None
    stats, count, kept = collections.Counter(), collections.Counter(), 0
    for start, hsz, fsz, ents in containers(data, foff, foff + fsize):
        for (_p, kind, ehsz, psize, arch) in ents:
            k = {1: "ptx", 2: "elf"}.get(kind, str(kind))
            stats[(k, arch)] += ehsz + psize
            count[(k, arch)] += 1
        if keep is None:
            continue
        has_elf = any(kind == 2 and arch in keep for (_, kind, _, _, arch) in ents)
        body = bytearray()
        for (p, kind, ehsz, psize, arch) in ents:
            if (kind == 2 and arch in keep) or (kind == 1 and not has_elf and arch <= max(keep)):
                body += data[p:p + ehsz + psize]
        if not body and ents:
            p, _k, ehsz, psize, _a = min(ents, key=lambda e: e[2] + e[3])
            body += data[p:p + ehsz + psize]
        kept += len(body)
        data[start + hsz:start + hsz + fsz] = body + bytes(fsz - len(body))
        struct.pack_into("<Q", data, start + 8, len(body))
    print(f"{a.so}: .nv_fatbin {fsize/1e6:.1f} MB")
    for (k, arch), b in sorted(stats.items(), key=lambda x: -x[1]):
        print(f"  {k} sm_{arch}: {count[(k, arch)]} entries, {b/1e6:.2f} MB")
    if keep is not None:
        print(f"kept {kept/1e6:.2f} MB")
        if a.out:
            with open(a.out, "wb") as f:
                f.write(data)

if __name__ == "__main__":
    main()
