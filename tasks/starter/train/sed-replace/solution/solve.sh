#!/bin/bash
sed -i 's/foo/bar/g' /app/text.txt
