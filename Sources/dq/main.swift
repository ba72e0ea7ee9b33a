import FHIRDataQueue
import ArgumentParser
print("x")
