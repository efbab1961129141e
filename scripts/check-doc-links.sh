#!/usr/bin/env bash
# Check the links of the project's Markdown files: every relative link must
# name a file or folder inside the repository, and every #anchor a heading
# of its target. Links to http(s) and mailto are not followed. Prints each
# broken link as FILE: LINK (reason) and exits 1 when there is one.
#   scripts/check-doc-links.sh [FILE.md ...]   (default: every tracked .md)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
root=$(pwd -P)

# slugs FILE: the GitHub anchors of FILE's headings, one a line (code
# fences skipped; lower case, punctuation dropped, spaces to hyphens).
slugs() {
  awk '/^```/ { fence = !fence; next } !fence && /^#+ / { sub(/^#+ +/, ""); print }' "$1" |
    tr '[:upper:]' '[:lower:]' |
    sed -e 's/[^a-z0-9 _-]//g' -e 's/ /-/g'
}

if [ $# -gt 0 ]; then files=("$@"); else mapfile -t files < <(git ls-files '*.md'); fi
bad=0
for f in "${files[@]}"; do
  dir=$(dirname "$f")
  # Inline links and images, outside code spans and fences.
  while IFS= read -r link; do
    case "$link" in
      http://* | https://* | mailto:*) continue ;;
    esac
    path=${link%%#*}
    anchor=""
    [[ $link == *"#"* ]] && anchor=${link#*#}
    if [ -z "$path" ]; then
      target=$f
    else
      target=$dir/$path
      if [ ! -e "$target" ]; then
        echo "$f: $link (no such file)"; bad=1; continue
      fi
      real=$(realpath "$target")
      if [[ $real != "$root" && $real != "$root"/* ]]; then
        echo "$f: $link (outside the repository)"; bad=1; continue
      fi
    fi
    if [ -n "$anchor" ] && [[ $target == *.md ]] && ! slugs "$target" | grep -qxF -- "$anchor"; then
      echo "$f: $link (no heading for #$anchor)"; bad=1
    fi
  done < <(awk '/^```/ { fence = !fence; next } !fence' "$f" |
    sed -e 's/`[^`]*`//g' |
    grep -oE '\]\([^) ]+\)' | sed -e 's/^](//' -e 's/)$//')
done
exit $bad
