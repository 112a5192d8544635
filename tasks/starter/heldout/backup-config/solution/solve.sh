#!/bin/bash
cp /app/settings.ini /app/settings.ini.bak
