#!/bin/bash
rm /app/junk.log
