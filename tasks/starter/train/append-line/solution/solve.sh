#!/bin/bash
echo done >> /app/todo.txt
