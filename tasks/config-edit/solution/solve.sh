#!/bin/bash
sed -i -e 's/^port = .*/port = 8080/' -e 's/^debug = .*/debug = false/' \
  -e 's/^workers = .*/workers = 4/' -e 's/^# log_level = .*/log_level = warning/' /app/app.conf
