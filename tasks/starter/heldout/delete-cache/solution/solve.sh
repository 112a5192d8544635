#!/bin/bash
rm /app/cache.tmp
