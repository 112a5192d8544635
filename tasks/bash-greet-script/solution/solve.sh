#!/bin/bash
cat > /app/greet.sh <<'SH'
#!/bin/bash
usage() { echo "usage: greet.sh [--shout] [--count N] NAME" >&2; exit 2; }
shout=0; count=1; name=""
while [ $# -gt 0 ]; do
  case "$1" in
    --shout) shout=1 ;;
    --count) shift; [ -n "$1" ] || usage; count="$1" ;;
    -*) usage ;;
    *) name="$1" ;;
  esac
  shift
done
[ -n "$name" ] || usage
msg="Hello, $name!"
[ "$shout" = 1 ] && msg="${msg^^}"
for ((i = 0; i < count; i++)); do echo "$msg"; done
SH
chmod +x /app/greet.sh
