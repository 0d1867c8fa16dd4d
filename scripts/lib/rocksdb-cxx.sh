#!/usr/bin/env bash
# The C++ compiler that cargo's `cc` runs for this target (.cargo/config.toml). Every
# compile goes straight to the real compiler (`$CXX`, else `c++`), except the 328 sources
# of the RocksDB that the rocksdb crate bundles (librocksdb-sys), which it builds in batches
# ("unity" translation units): each of their sources parses the same heavy headers and
# instantiates the same templates, so one translation unit per batch does that once: 5.8
# CPU-minutes for all of them against 30 (30 sources of db/: 31 s against 108 s), and a
# fresh two-core machine's build 7 minutes shorter.
#
# `cc` compiles each source on its own into its own object and archives them all. Here the
# first source of a batch compiles the whole batch into its object, and the batch's other
# sources get an empty object; the archive holds the same code. Batches follow the order of
# the crate's rocksdb_lib_sources.txt: up to BATCH sources of one folder. If a batch does
# not compile as one unit (two of its sources define the same name in their own file),
# its sources are compiled one by one and linked into the first one's object (`ld -r`):
# slower, same result, and said on stderr (cargo shows it with -vv). KM0_ROCKSDB_BATCH
# sets the batch size (24: the 328 sources in 24 batches, two cores kept busy).
set -uo pipefail
real=${CXX:-c++}
BATCH=${KM0_ROCKSDB_BATCH:-24}

src=${*: -1}
out=""
prev=""
for a in "$@"; do
  [ "$prev" = -o ] && out=$a
  prev=$a
done
list=rocksdb_lib_sources.txt
case "$src" in
  rocksdb/*.cc) ;;
  *) exec "$real" "$@" ;;
esac
if [ -z "$out" ] || [ ! -f "$list" ] || [ ! -f rocksdb/include/rocksdb/db.h ]; then
  exec "$real" "$@"
fi
file=${src#rocksdb/}

# The batch of $file: its members, one per line, the first being the one that compiles it.
members=$(awk -v want="$file" -v batch="$BATCH" '
  { gsub(/[ \t\r]/, "") }
  $0 == "" || $0 == "util/build_version.cc" { next }
  {
    dir = $0; sub(/\/.*/, "", dir)
    if (n == 0 || dir != last || n >= batch) { id++; n = 0 }
    n++; last = dir
    group[id] = group[id] $0 "\n"
    if ($0 == want) mine = id
  }
  END { if (mine) printf "%s", group[mine] }
' "$list")
case "$members" in
  "$file"$'\n'* | "$file") ;;
  "")
    exec "$real" "$@" ;; # not one of the listed sources: compiled as asked
  *)
    # Not the first of its batch: the first one's object holds its code.
    empty="${out%.o}.km0-empty.cc"
    : >"$empty"
    exec "$real" "${@:1:$#-1}" "$empty" ;;
esac

unity="${out%.o}.km0-batch.cc"
{
  echo "// Sources of RocksDB compiled as one unit by scripts/lib/rocksdb-cxx.sh"
  while IFS= read -r m; do
    [ -n "$m" ] && printf '#include "%s/rocksdb/%s"\n' "$PWD" "$m"
  done <<<"$members"
} >"$unity"
if "$real" "${@:1:$#-1}" "$unity" 2>"$unity.err"; then
  exit 0
fi
echo "rocksdb-cxx: the batch of $file did not compile as one unit; compiling its sources one by one:" >&2
head -n 5 "$unity.err" >&2
parts=()
i=0
while IFS= read -r m; do
  [ -n "$m" ] || continue
  i=$((i + 1))
  part="${out%.o}.km0-part$i.o"
  args=("$@")
  args[$#-1]="rocksdb/$m"
  for j in "${!args[@]}"; do
    [ "${args[j]}" = -o ] && args[j+1]=$part
  done
  "$real" "${args[@]}" || exit 1
  parts+=("$part")
done <<<"$members"
exec "${LD:-ld}" -r -o "$out" "${parts[@]}"
