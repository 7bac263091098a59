#!/usr/bin/env bash
# On the GPU machine, in every call of the issue-25 sitting (make_v0_engine_bundle.sh made the
# pieces here): take whatever .carry/v0pNN folders this call carried. Each piece is checked against
# MANIFEST (sha256) and kept in V0_PARTS; a piece already kept is skipped, so a call that broke can
# simply be repeated. Once every piece of an archive is kept, the archive is unpacked in the
# background (its own session: it outlives this call and overlaps the next transfers), checking
# the whole archive's sha256 while it streams: torch.tar.xz into V0_SITE; wheels.tar into
# V0_WHEELS, whose wheels are then installed into V0_SITE in parallel (etcd: V0_WHEELS/bin/etcd).
# V0_SITE/.GROUP-done marks a group complete.
# Prints one line: what arrived, what is missing, what is unpacked.
#   bash scripts/gpu/v0_take.sh            (then, when all are unpacked: scripts/gpu/v0_engine.sh)
set -uo pipefail
P=${V0_PARTS:-/tmp/v0parts}
S=${V0_SITE:-/tmp/v0site}
W=${V0_WHEELS:-/tmp/v0wheels}
mkdir -p "$P" "$S"
[ -f .carry/v0p00/MANIFEST ] && cp .carry/v0p00/MANIFEST "$P/MANIFEST"
[ -f "$P/MANIFEST" ] || { echo "[v0_take] no MANIFEST yet: carry .carry/v0p00 first"; exit 1; }
bad=0
for f in .carry/v0p[0-9]*/*.part.*; do
  [ -f "$f" ] || continue
  name=$(basename "$f")
  [ -f "$P/$name" ] && continue
  want=$(awk -v n="$name" '$1 == "piece" && $3 == n {print $4}' "$P/MANIFEST")
  if [ "$(sha256sum "$f" | cut -d' ' -f1)" = "$want" ]; then cp "$f" "$P/$name.tmp" && mv "$P/$name.tmp" "$P/$name"
  else echo "[v0_take] $name: sha256 MISMATCH (carry its folder again)"; bad=1; fi
done
missing=()
while read -r _ archive sha _size; do
  g=${archive%%.*}
  need=$(awk -v g="$g." '$1 == "piece" && index($3, g) == 1 {print $3}' "$P/MANIFEST")
  have_all=1
  for n in $need; do [ -f "$P/$n" ] || { have_all=0; missing+=("$n"); }; done
  if [ "$have_all" = 1 ] && [ ! -e "$S/.$g-done" ] && [ ! -e "$P/$g.unpacking" ]; then
    touch "$P/$g.unpacking"
    # its own session, so it outlives this call; it writes the done mark itself
    # shellcheck disable=SC2046
    dest=("$S"); [ "$g" = wheels ] && dest=("$W" --install-wheels "$S")
    setsid python3 "$(dirname "$0")/carry_tool.py" unpack-stream "${dest[0]}" "$sha" "$S/.$g-done" \
      $(for n in $need; do echo "$P/$n"; done) "${dest[@]:1}" > "$P/$g.log" 2>&1 < /dev/null &
  fi
done < <(grep '^archive ' "$P/MANIFEST")
done_groups=$(cd "$S" && ls -A | sed -n 's/^\.\(.*\)-done$/\1/p' | tr '\n' ' ')
unpacking=$(cd "$P" && for u in *.unpacking; do [ -e "$u" ] && [ ! -e "$S/.${u%.unpacking}-done" ] && echo -n "${u%.unpacking} "; done)
failed=$(cd "$P" && grep -l -E "MISMATCH|Traceback|Error" ./*.log 2>/dev/null | sed 's|^\./||; s|\.log$||' | tr '\n' ' ')
[ -n "$failed" ] && { echo "[v0_take] UNPACK FAILED: $failed (see $P/<group>.log)"; bad=1; }
echo "[v0_take] kept $(ls "$P" | grep -c '\.part\.') of $(grep -c '^piece ' "$P/MANIFEST") pieces;" \
  "missing: ${#missing[@]}${missing:+ (first ${missing[0]})}; unpacking: ${unpacking:-none}; done: ${done_groups:-none}"
exit $bad
