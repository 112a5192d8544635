#!/bin/bash
ln -s /app/v2 /app/latest
