"""The built wheel and sdist hold the library (fusedlayers/), its license and metadata, nothing else at top level."""

import sys
import tarfile
import zipfile
from pathlib import Path

dist = Path(sys.argv[1])
(wheel,) = dist.glob("*.whl")
(sdist,) = dist.glob("*.tar.gz")
version = wheel.name.split("-")[1]

in_wheel = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
assert in_wheel == {"fusedlayers", f"fusedlayers-{version}.dist-info"}, f"wheel top level: {sorted(in_wheel)}"
licenses = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("/LICENSE")]
assert licenses, "the wheel holds no LICENSE"

metadata = {"PKG-INFO", "pyproject.toml", "setup.cfg", "README.md", "LICENSE", "MANIFEST.in", "fusedlayers.egg-info"}
with tarfile.open(sdist) as archive:
    in_sdist = {Path(name).parts[1] for name in archive.getnames() if len(Path(name).parts) > 1}
assert in_sdist - metadata == {"fusedlayers"}, f"sdist top level: {sorted(in_sdist)}"
print(f"ok  {wheel.name}: {sorted(in_wheel)}; {sdist.name}: {sorted(in_sdist)}")
