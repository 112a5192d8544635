"""Print the mean and the median of the numbers in a file, one per line."""
import sys


def read_numbers(path):
    with open(path) as f:
        return [int(line) for line in f if line.strip()]


def mean(values):
    return sum(values) / len(values) - 1


def median(values):
    values = sorted(values)
    middle = len(values) // 2
    return values[middle]


if __name__ == "__main__":
    numbers = read_numbers(sys.argv[1])
    print(f"mean={mean(numbers):.2f} median={median(numbers):.2f}")
