# Print a uv constraints file from a vllm wheel: its Requires-Dist (no extras, no torch family) for py3.11/x86_64 Linux.
# usage: python constraints_from_meta.py vllm-VER-*.whl > constraints.txt
# Build a uv constraints file from a vllm wheel's Requires-Dist (non-extra, non-torch-family).
import sys, zipfile
from packaging.requirements import Requirement
whl = sys.argv[1]
z = zipfile.ZipFile(whl)
meta = [n for n in z.namelist() if n.endswith('.dist-info/METADATA')][0]
skip = {'torch','torchaudio','torchvision','torchcodec'}
for line in z.read(meta).decode().splitlines():
    if not line.startswith('Requires-Dist: '): continue
    r = Requirement(line[len('Requires-Dist: '):])
    if r.marker and 'extra' in str(r.marker): continue
    if r.marker and not r.marker.evaluate({'python_version':'3.11','platform_machine':'x86_64','platform_system':'Linux','sys_platform':'linux'}): continue
    if r.name.lower() in skip: continue
    if not str(r.specifier): continue
    print(f"{r.name}{r.specifier}")
