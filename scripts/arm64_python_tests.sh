#!/usr/bin/env bash
# A slice of the Python tests on an emulated AArch64 machine, from an x86-64 one: Debian's arm64 Python 3.11 run by
# qemu-aarch64 (-cpu max: FEAT_BF16, so the neon-bf16 ISA is the default and the bf16 dot path tests run on it),
# numpy / ml_dtypes / pytest from their aarch64 wheels, and the extension cross-compiled with the sources and flags
# setup.py would use on AArch64. Everything goes into a scratch folder (default: a new temporary one); nothing is
# installed on the system: Debian's arm64 packages are fetched with apt-get under a private state folder.
#
#   bash .ci/install-arm && bash scripts/arm64_python_tests.sh [pytest args]   (default: the kernel tests)
#
# The slice is what runs without torch (no aarch64 torch here): tests/test_kernels.py and test_bench_kernels.py,
# with --noconftest (the conftest's fixtures need torch). test_back_to_back_jobs_with_late_workers_stay_exact is
# deselected: it starts sys.executable, an arm64 binary the kernel cannot exec without binfmt_misc.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${ARM64_SCRATCH:-$(mktemp -d)}
SR=$WORK/sysroot
mkdir -p "$WORK"/apt/lists/partial "$WORK"/apt/cache/archives/partial "$WORK"/debs "$WORK"/wheels "$WORK"/site "$SR"
touch "$WORK"/apt/status

APT=(-o APT::Architecture=arm64 -o APT::Architectures::=arm64 -o Dir::State::Lists="$WORK"/apt/lists
  -o Dir::State::status="$WORK"/apt/status -o Dir::Cache="$WORK"/apt/cache -o Debug::NoLocking=1)
if [ ! -x "$SR"/usr/bin/python3.11 ]; then
  apt-get "${APT[@]}" -qq update
  # the interpreter, its headers and the libraries it and the wheels link
  (cd "$WORK"/debs && apt-get "${APT[@]}" -qq download python3.11-minimal libpython3.11-minimal \
    libpython3.11-stdlib libpython3.11-dev libc6 libexpat1 zlib1g libffi8 libssl3 libbz2-1.0 liblzma5 \
    libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libuuid1 libgcc-s1 libstdc++6 libcrypt1 libdb5.3 libnsl2 \
    libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1 media-types)
  for deb in "$WORK"/debs/*.deb; do dpkg-deb -x "$deb" "$SR"; done
fi
if [ -z "$(ls "$WORK"/site)" ]; then
  python3 -m pip download -q --only-binary=:all: --platform manylinux2014_aarch64 --python-version 3.11 \
    --implementation cp -d "$WORK"/wheels numpy ml_dtypes pytest
  for whl in "$WORK"/wheels/*.whl; do python3 -m zipfile -e "$whl" "$WORK"/site; done
fi

# a copy of the package with the AArch64 build of the extension (setup.py's AArch64 sources and flags)
rm -rf "$WORK"/tree && mkdir -p "$WORK"/tree && cp -r "$ROOT"/fastar "$ROOT"/tests "$WORK"/tree/
find "$WORK"/tree -name '*.so' -delete
CSRC="$WORK"/tree/fastar/quant/csrc
SOURCES=$(cd "$ROOT" && python3 -c "
import ast, pathlib
tree = ast.parse(pathlib.Path('setup.py').read_text())
names = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
         if isinstance(t, ast.Name) and t.id in ('COMMON', 'ARM64')}
print(' '.join(names['COMMON'] + names['ARM64']))")
aarch64-linux-gnu-gcc -O3 -std=gnu11 -fno-strict-aliasing -Wall -Wno-unknown-pragmas -pthread -fPIC -shared \
  -I"$SR"/usr/include -I"$SR"/usr/include/python3.11 -I"$CSRC" $(for f in $SOURCES; do echo "$CSRC/$f"; done) -lm \
  -o "$WORK"/tree/fastar/quant/_kernels.cpython-311-aarch64-linux-gnu.so

cd "$WORK"/tree
if [ $# -eq 0 ]; then
  set -- tests/test_kernels.py tests/test_bench_kernels.py --deselect \
    tests/test_kernels.py::test_back_to_back_jobs_with_late_workers_stay_exact
fi
PYTHONPATH="$WORK"/site:"$WORK"/tree qemu-aarch64 -cpu max -L "$SR" "$SR"/usr/bin/python3.11 -c \
  "from fastar.quant import kernels as K; print('AArch64 Python, kernels ISA', K.get_isa(), K.cpu_features()['usable_isas'])"
PYTHONPATH="$WORK"/site:"$WORK"/tree exec qemu-aarch64 -cpu max -L "$SR" "$SR"/usr/bin/python3.11 -m pytest -q \
  -p no:cacheprovider -p no:randomly --noconftest -rs "$@"
