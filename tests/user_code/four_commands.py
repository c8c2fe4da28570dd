"""A user's script that runs four commands of the Python API one after another in one process: train, evaluate that
run, predict with it, then train a second run. Under a launcher every process runs all four in the same process
group. Each process writes what each command returned to OUT/returned-RANK.json (processes print at once: a file
keeps each whole).

    python tests/user_code/four_commands.py OUT PICTURES KEY=VALUE ...
"""

import json
import os
import sys

import accel_train


def main(out: str, pictures: str, settings: list[str]) -> dict:
    trained = accel_train.train("fashion_mnist_cnn", [*settings, f"output_dir={out}/first"])
    evaluated = accel_train.evaluate(f"{out}/first")
    predicted = accel_train.predict(f"{out}/first", inputs=pictures)
    again = accel_train.train("fashion_mnist_cnn", [*settings, f"output_dir={out}/second"])
    return {"trained": trained, "evaluated": evaluated, "predicted": predicted, "again": again}


if __name__ == "__main__":
    returned = main(sys.argv[1], sys.argv[2], sys.argv[3:])
    with open(os.path.join(sys.argv[1], f"returned-{os.environ.get('RANK', 0)}.json"), "w") as file:
        json.dump(returned, file)
