# Sourced by the pack_for_device scripts (benchmarks/, training/): what a device transfer
# may hold, and how wheels for the GPU machine's Python are fetched.

# Bytes of one piece: each transfer also carries the tracked files, so a piece is what is
# left of the 64 MiB limit after them, less 3 MB.
piece_bytes() {
  local tracked
  tracked=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  echo $(( 67108864 - tracked - 3000000 ))
}

# wheels DEST SPEC...: binary wheels for the GPU machine (CPython 3.12, manylinux x86_64).
wheels() {
  local dest=$1; shift
  "${PACK_PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dest" "$@"
}

# .xfer is ignored by git (transfers carry ignored paths only when named)
grep -qx '/.xfer/' .git/info/exclude 2>/dev/null || echo '/.xfer/' >> .git/info/exclude
