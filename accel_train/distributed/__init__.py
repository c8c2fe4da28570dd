"""The in-process runtime of a distributed run: the launcher's environment read once, the devices, the Accelerator and
the launch checks, the collectives behind the loop's decisions, stop signals and the stuck-process watchdog.

Everything that reads an environment variable, a rank or a process group is here; the rest of the package sees an
`Accelerator` and these calls.
"""
