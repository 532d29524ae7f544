"""Build hook: ship ``mrl_plugins_autoenable.pth`` at the site-packages root.

The .pth line imports nothing unless ``MRL_PLUGINS`` is set (coverage.py's env-gated start-up hook
is the precedent), so ``trl grpo --config x.yaml`` with ``MRL_PLUGINS`` in the YAML's ``env:`` block
switches the plugins on in the training processes that ``accelerate launch`` starts.
"""

import base64
import hashlib
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "mrl_plugins_autoenable.pth"
PTH_LINE = (
    "import os; os.environ.get('MRL_PLUGINS') and "
    "__import__('mrl_plugins._autoenable', fromlist=['install']).install()\n"
)


class build_py_with_pth(build_py):  # noqa: N801 - setuptools command naming
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / PTH_NAME
        target.write_text(PTH_LINE, encoding="utf-8")

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH_NAME)]


class editable_wheel_with_pth(editable_wheel):  # noqa: N801 - setuptools command naming
    """Editable installs do not ship build_py's extra files: add the .pth to the editable wheel."""

    def run(self) -> None:
        super().run()
        for wheel in Path(self.dist_dir).glob("*.whl"):
            _add_to_wheel(wheel, PTH_NAME, PTH_LINE.encode())


def _add_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    with zipfile.ZipFile(wheel) as zf:
        if name in zf.namelist():
            return
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        record_text = zf.read(record).decode()
        entries = [(i, zf.read(i)) for i in zf.infolist() if i.filename != record]
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record_text += f"{name},sha256={digest},{len(data)}\n"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for info, content in entries:
            zf.writestr(info, content)
        zf.writestr(name, data)
        zf.writestr(record, record_text)


setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth})
