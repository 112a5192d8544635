#!/bin/bash
cd /app/photos
for f in IMG_*; do
  if [[ "$f" =~ ^IMG_([0-9]+)\.([Jj][Pp][Gg]|[Jj][Pp][Ee][Gg])$ ]]; then
    mv -- "$f" "photo-${BASH_REMATCH[1]}.jpg"
  fi
done
