"""Write a GGUF holding a range of another llama GGUF's layers, renumbered from 0, with
every other tensor (embedding, output norm, output head) and all metadata, block_count
set to the range's length. Tensor bytes are copied as they are. Used to carry the test
model to a GPU machine in halves (one device call carries at most 64 MiB; docs/CUDA.md).

    PYTHONPATH=~/.cache/cawsfs/llama.cpp-*/gguf-py python3 scripts/gguf-layers.py SRC OUT FIRST END [--layers-only]

--layers-only leaves the other tensors out (the embedding alone is a third of the test
model), so a part of later layers fits one carry.
"""
import sys

import gguf

layers_only = '--layers-only' in sys.argv[5:]
if len(sys.argv) not in (5, 6) or (len(sys.argv) == 6 and not layers_only):
    sys.exit(__doc__)
src, out, lo, hi = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
r = gguf.GGUFReader(src)
w = gguf.GGUFWriter(out, arch='llama')
for k, f in r.fields.items():
    if k.startswith('GGUF.') or k == 'general.architecture': continue
    t = f.types[0]
    if k == 'llama.block_count':
        w.add_uint32(k, hi - lo); continue
    if t == gguf.GGUFValueType.ARRAY:
        if f.types[1] == gguf.GGUFValueType.STRING:
            vals = [bytes(f.parts[i]).decode('utf-8', errors='surrogateescape') for i in f.data]
        else:
            vals = [f.parts[i].tolist()[0] for i in f.data]
        w.add_array(k, vals)
    elif t == gguf.GGUFValueType.STRING:
        w.add_string(k, bytes(f.parts[f.data[0]]).decode())
    else:
        w.add_key_value(k, f.parts[f.data[0]].tolist()[0], t)
for t in r.tensors:
    name = t.name
    if name.startswith('blk.'):
        n = int(name.split('.')[1])
        if not lo <= n < hi: continue
        name = 'blk.%d.%s' % (n - lo, name.split('.', 2)[2])
    elif layers_only:
        continue
    w.add_tensor(name, t.data, raw_dtype=t.tensor_type)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
