#!/usr/bin/env bash
# TileLang 0.1.11 (and its runtime packages) for TileKernels' GitHub layout (commit 36d9e45 imports
# tilelang.utils.target, gone by 0.1.14): one xz'd site folder, as ../shared/device/make-tilelang-bundle.sh
# packs 0.1.15 for the pip package. Without tile-kernels: the layout comes from .anchors/tilekernels-github.
#   bash dev/make-tilelang-gh-bundle.sh .tilelang-gh
#   run(command="TL_BUNDLE=.tilelang-gh TK_STEPS='versions pytest' bash dev/gpu-session.sh tilekernels",
#       carry=[".tilelang-gh", ".anchors"])
set -euo pipefail
out="${1:?output folder, e.g. .tilelang-gh}"; mkdir -p "$out"; out="$(cd "$out" && pwd)"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT; cd "$tmp"
plat=(--python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64)
pip download -q --no-deps "${plat[@]}" -d w tilelang==0.1.11 "apache-tvm-ffi>=0.1.10,<0.1.12" \
  "z3-solver>=4.13.0,<4.15.5" torch-c-dlpack-ext 2>&1 | grep -v "^WARNING" || true
mkdir site && python3 - <<'PY'
import glob, os, zipfile
for w in glob.glob("w/*.whl"):          # unzip, keeping each file's mode (z3's and TileLang's libraries)
    with zipfile.ZipFile(w) as z:
        for i in z.infolist():
            path = z.extract(i, "site")
            mode = i.external_attr >> 16
            if mode and not i.is_dir():
                os.chmod(path, mode & 0o777)
PY
tar -cf - -C site . | xz -6 -T0 > "$out/tilelang-site.tar.xz"
ls -la "$out/tilelang-site.tar.xz"
