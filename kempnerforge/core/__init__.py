"""The bottom floor: logging, the error types and the metrics.jsonl format, which every other
package may use and which import nothing of the package themselves."""
